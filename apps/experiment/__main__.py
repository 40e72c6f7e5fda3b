import sys

from sgl_fair.experiment.cli import main

sys.exit(main())
