"""The math and the objects a user holds. RoPE stripping and re-applying (`rope`), the streaming sufficient
statistics of a fit (`stats`), the closed-form ridge and reduced-rank solves (`ridge`, `lowrank`), one class per
mapper type (`layer_maps`), the mapper itself with its checkpoint, card and Hub code (`mapper`, `checkpoint`,
`card`, `hub`), a model's own cache for a prompt (`capture`), model loading (`loading`) and `TransferredCache`
(`cache`). Imports nothing else of the package but `version`.
"""
