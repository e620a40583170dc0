import sys

from conductor.replay.main import main

sys.exit(main())
