"""`python -m eagle3ft STAGE ARGS`: the `eagle3ft` command (eagle3ft/commands.py)."""

from eagle3ft.commands import main

main()
