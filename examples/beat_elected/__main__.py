"""Three beats, one elected to send; the active one is killed, then stopped past its session."""
import sys

from examples.beat_elected.scenario import main

sys.exit(main())
