"""`python -m services.kvstore [--capacity-bytes 2GiB]`"""
import sys

from services.kvstore.service import add_arguments, build
from shared.service_runner import main_for

if __name__ == "__main__":
    sys.exit(main_for("kvstore", add_arguments, build))
