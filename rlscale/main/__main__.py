"""`python -m rlscale.main`: the training command (`rlscale.main.train`)."""

from rlscale import cli
from rlscale.main import train

cli.run_command(train.define_flags, train.main)
