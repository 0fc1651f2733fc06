"""The `vitray` command line: `cli/app.py` holds the app and the shared options, one module per
command group adds its commands, `cli/main.py` imports them all (`python -m vitray.cli ARGS...`)."""
