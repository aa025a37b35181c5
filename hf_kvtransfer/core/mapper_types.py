"""The names of the mapper types, spelled in this one place: each is the `mapper_type` of one layer-map class in
`layer_maps` (and of `MapperConfig`). A module of its own so that the CLI's parser can name them without importing
torch."""

RIDGE = "ridge"  # a closed-form ridge map per target layer
LOWRANK = "lowrank"  # the same map in reduced rank (`lowrank.py`)
MLP = "mlp"  # a small MLP per K and V, fit by gradient descent (`fitting/mlp.py`)

__all__ = ["LOWRANK", "MLP", "RIDGE"]
