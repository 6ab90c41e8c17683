from ms_llm.cli import main

raise SystemExit(main())
