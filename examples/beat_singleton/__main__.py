import sys

from examples.beat_singleton.scenario import main

sys.exit(main())
