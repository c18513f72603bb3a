"""`python -m unison.runner`: unisonrun."""
import sys

from unison.runner.launch import main

sys.exit(main())
