"""The subcommands of the ``pagedkv`` command line, one module per group of commands.

Each module has ``register(subparsers)``, which adds its commands to the ``pagedkv`` parser and
sets ``handler=`` (a function ``(args) -> exit status``) on each; `pagedkv.cli.COMMANDS` lists
them. Shared option groups and argument types are in `pagedkv.commands.args`; ``--json`` and
``--plot`` handling in `pagedkv.commands.output`. Commands only parse their flags and call the
library (`pagedkv.sim` ...); they hold no experiment logic.
"""
