"""Reserved for the host tier (issues 3 and 4); nothing here yet."""
