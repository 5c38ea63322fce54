from verl_core.cli import main

raise SystemExit(main())
