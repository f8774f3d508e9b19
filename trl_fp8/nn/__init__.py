"""FP8 modules and the conversion of a model to them."""
