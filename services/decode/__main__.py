import sys

from services.decode.service import add_arguments, build
from shared.service_runner import main_for

sys.exit(main_for("decode", add_arguments, build))
