// BwdParams now lives beside FwdParams in csrc/params.h. This header only forwards there, so
// that kernel files which still include it keep building; include "params.h" instead.
#pragma once
#include "params.h"
