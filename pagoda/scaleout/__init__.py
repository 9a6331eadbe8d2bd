"""Scale-out on an existing distributed engine: the Ray Serve app (replicas of pagoda's server),
its prefix-affine routing, request forwarding and SLO autoscaling. Above the server: each replica
runs it."""
