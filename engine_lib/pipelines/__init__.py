"""Pipeline adapters: the contract (`base`), the shared flow-matching skeleton, the registry,
and one package per pipeline (`<name>/adapter.py` + `<name>/tiny.py`)."""
