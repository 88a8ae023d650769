"""The command line: a thin Typer layer over the engine (one module per command)."""
