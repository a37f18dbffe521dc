import sys

from examples.flash_sale.scenario import main

sys.exit(main())
