"""What is kept beside each stored token, and which tokens stay: state, slots, importance, selection, protection."""
