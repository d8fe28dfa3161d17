"""`python -m services.tokenizer --model DIR`"""
import sys

from services.tokenizer.service import add_arguments, build
from shared.service_runner import main_for

if __name__ == "__main__":
    sys.exit(main_for("tokenizer", add_arguments, build))
