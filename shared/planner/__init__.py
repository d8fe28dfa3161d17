"""The planner (`kvmesh up --planner load|sla`): sizes the prefill and decode roles to the load while serving."""
