import sys

from services.prefill.service import add_arguments, build
from shared.service_runner import main_for

sys.exit(main_for("prefill", add_arguments, build))
