"""KV hand-off between prefill and decode instances: packing plans, sender/receiver protocol, NIXL and TCP backends."""
