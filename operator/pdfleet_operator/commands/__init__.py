"""Sub-commands of `pdfleet`; each module has ``register(subparsers)``.

A command sets ``handler=callable(args) -> int`` on its parser.
"""

from pdfleet_operator.commands import demo, dev, digest, doctor, layout, matrix, render, validate

COMMANDS = (demo, dev, digest, doctor, layout, matrix, render, validate)
__all__ = ["COMMANDS"]
