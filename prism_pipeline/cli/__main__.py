"""`python -m prism_pipeline.cli`: the `prism` command."""

import sys

from prism_pipeline.cli.main import main

sys.exit(main())
