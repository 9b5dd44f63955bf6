"""The standard benchmark workloads (`kvgate bench ...`) and the fleet simulation harness: kept out of the
runtime packages, which never import them."""
