import sys

from lossless_hc.bench.cli import main

sys.exit(main())
