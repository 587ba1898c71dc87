"""Named model configs (JSON), installed as the ``specjax.configs`` package."""
