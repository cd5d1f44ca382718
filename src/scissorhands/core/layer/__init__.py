"""One layer's budgeted K/V: the layer, its attention arithmetic, its decode modes, its footprint and audit."""
