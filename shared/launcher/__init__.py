"""Running the mesh: `kvmesh up` (every service as a local process) and `kvmesh serve <service>`.

spec.py is the single description of what runs with which flags; compose/docker-compose.yml is
checked against it by tests/test_launcher.py.
"""
