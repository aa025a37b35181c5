"""Making a mapper: the validated fit configuration (`config`), calibration text (`calibration`), the one pass of
calibration tokens through both models (`calibration_pass`), the statistics consumer (`accumulate`), the MLP fitter
(`mlp`), `fit_mapper` / `solve_mapper` (`fit`) and the content probe that chooses how many target layers a cache
computes itself (`exact_layers`). Imports `core` and `evaluation` (the probe scores content).
"""
