import sys

from sgl_fair.launch.serve import main

sys.exit(main())
