"""Analysis that is not training: the packing-overhead profile (``profiling``) and
the paper's scaling maths (``scaling``)."""
