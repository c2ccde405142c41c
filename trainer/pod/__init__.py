"""A worker pod of several trainer processes (one per GPU): its launcher and control relay."""
