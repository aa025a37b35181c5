"""Token tables and the first-layer table: two map inputs defined outside the library, as a plug-in.

Importing this package registers both with the library's map-input registry (`register_map_input`), so a mapper saved
with them (`map_inputs.token_tables`, `map_inputs.first_layer_table` in its config.json) loads, transfers, plans and
serves as the library's own inputs do; without the import, loading one is refused in one line naming the input.
They are off the library's default fit (see ../README.md: tables on every mapped layer of Qwen3 14B -> 32B take
146 GiB); `table_refiner` hands the fit's content probe candidates with tables (`fit_mapper(..., refine=...)`).

    import sys; sys.path.insert(0, "research/token_tables")
    import token_tables_plugin  # registers token_tables and first_layer_table
    mapper = KVMapper.from_pretrained("research/token_tables/results/mappers/small_to_large_tables")
"""

from .first_layer import FirstLayerTable, FirstLayerTableConfig, FirstLayerTableInput
from .fit import (
    DEFAULT_TOKEN_LAGS,
    DEFAULT_TOKEN_PSEUDO_COUNT,
    TableInputs,
    can_fold_residual,
    capture_table_inputs,
    fit_token_tables,
    fold_residual_into_tables,
    solve_token_tables,
    table_inputs_nbytes,
    table_refiner,
    table_rows,
    tabulate_first_layer,
    token_residuals,
    token_table_rows_nbytes,
    token_tables_nbytes,
    with_token_tables,
)
from .tables import (
    TokenTableConfig,
    TokenTableInput,
    TokenTables,
    lagged_token_ids,
    token_table_config,
    token_table_parameters,
    token_table_readers,
)

__all__ = [
    "DEFAULT_TOKEN_LAGS",
    "DEFAULT_TOKEN_PSEUDO_COUNT",
    "FirstLayerTable",
    "FirstLayerTableConfig",
    "FirstLayerTableInput",
    "TableInputs",
    "TokenTableConfig",
    "TokenTableInput",
    "TokenTables",
    "can_fold_residual",
    "capture_table_inputs",
    "fit_token_tables",
    "fold_residual_into_tables",
    "lagged_token_ids",
    "solve_token_tables",
    "table_inputs_nbytes",
    "table_refiner",
    "table_rows",
    "tabulate_first_layer",
    "token_residuals",
    "token_table_config",
    "token_table_parameters",
    "token_table_readers",
    "token_table_rows_nbytes",
    "token_tables_nbytes",
    "with_token_tables",
]
