import sys

# Before torch loads libgomp, which reads its wait policy once (a worker started by hand gets it too).
from shared.engine.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()

from services.decode.service import add_arguments, build
from shared.service_runner import main_for

sys.exit(main_for("decode", add_arguments, build))
