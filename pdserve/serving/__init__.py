"""The HTTP and process edge every pdserve server shares (router and instances): error bodies and
range checks, the uvicorn config, the cluster secret, draining, the instance loop, the watchdog and
free ports. Torch-free."""
