"""What users set, declared once: the settings, budgets and schedules (imports no torch)."""
