import sys

from sgl_fair.demo import main

sys.exit(main())
