"""Reserved for the storage tier (issues 3 and 4); nothing here yet."""
