"""The command line: `moeheal` and its subcommands."""
