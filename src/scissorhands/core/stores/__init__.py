"""Where a budgeted layer keeps K and V: the store interface, the dense and packed stores, the residual."""
