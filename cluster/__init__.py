"""Cluster wiring: connecting to Ray, the asynchronous pipeline's driver, Serve deployments, dashboards."""
