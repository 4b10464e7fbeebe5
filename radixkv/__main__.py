"""``python -m radixkv ...`` is the ``radixkv`` console script."""

import sys

from radixkv.cli import main

sys.exit(main())
