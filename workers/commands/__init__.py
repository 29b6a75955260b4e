"""One module per `detok` command, each with all its argparse code."""
