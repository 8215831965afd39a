"""Weight mappings from role-keyed MTP weights into drafter formats (EAGLE, EAGLE-3, Medusa)."""
