import sys

from mhf_dist.cli import main

sys.exit(main())
