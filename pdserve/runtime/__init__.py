"""The rank runtime: rank processes and their launcher, collectives (gloo, shared memory), devices
and placement, tensor and expert parallel weight slicing, multi-node groups (node link, agents),
fault seams and the per-rank memory checks. Servers build on it; it imports no server."""
