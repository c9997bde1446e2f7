"""Data, no drawing: fingerprints and route tables, figure data, bench data, the playground's
parameters and compute cache."""
