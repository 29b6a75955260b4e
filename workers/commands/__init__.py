"""The `detok` subcommands, one module per command, each holding all of its argparse code.

A command module exposes `add_command(subparsers)`, which registers a parser whose `func(args)`
returns the process exit code; it turns flags into the arguments of a library function
(`workers.io.replay`, `workers.kafka.topics`, ...) and that function's errors into messages and
exit codes. Flags several commands share are declared once, in `workers.commands.options`.
"""
