import sys

from examples.retry_on_timeout.scenario import main

sys.exit(main())
