import sys

from sgl_fair.loadtest import main

sys.exit(main())
