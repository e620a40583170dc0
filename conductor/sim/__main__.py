import sys

from conductor.sim.main import main

sys.exit(main())
